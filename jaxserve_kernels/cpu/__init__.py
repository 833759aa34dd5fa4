"""What the C++ CPU kernels share: their build (`build.py`) and their common header (`common.h`)."""
