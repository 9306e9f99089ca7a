"""Offline quantization, apart from the engine's runtime: `tokenfleet quantize` (`convert.py`) writes a checkpoint's
int8 / int4 copy, its int4 scaled by AWQ (`awq.py`) on calibration text (`calibration.txt`), which the engine then
serves as any quantized checkpoint."""
