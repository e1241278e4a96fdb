"""TensorRT-LLM PyTorch-backend path for the Qwen-VL family."""
