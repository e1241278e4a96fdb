"""Speculative decoding with the checkpoint's MTP head (Qwen3.5 / Qwen3.6): the user's
`MTPDecodingConfig`, the verify step, greedy acceptance, recurrent-state rollback and the MTP
drafter. `PyExecutor` calls `SpecDecoder.run_step` from one hook."""
