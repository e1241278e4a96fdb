"""trtllm-bench: image+text serving workloads on random weights at real model sizes."""
