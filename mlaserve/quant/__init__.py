"""Quantized weights kept in their stored form: the checkpoint's quantization scheme, the block
formats and the modules that hold them (see linear.py for the module interface)."""
