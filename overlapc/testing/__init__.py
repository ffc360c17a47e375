"""Process pools and the emulated cluster for tests, the demo, calibration and benchmarks: not
part of the compiler's API."""
