"""llmpipe's C kernels (`csrc/`) and the helper that builds and loads them (`build`)."""
