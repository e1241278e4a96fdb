"""Console entry points: `trtllm-serve` (serve.py) and `trtllm-bench` (bench.py)."""
