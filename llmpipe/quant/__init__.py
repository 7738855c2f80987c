"""Weight and KV-cache quantization: formats, kernels, and the GPTQ / AWQ calibrated methods."""
