"""Kernels beside the engine's plain torch: `cpu/` holds C kernels built on first use (the
GGUF block matmul decode runs on); Triton kernels, one op per module with a launcher and a
plain-torch reference, land here as the GPU path needs them."""
