"""TensorRT engines wherever they are built, shared by the build stage and deploy's install-time builds.

The version matrix (`flags`: which ONNX file and which options a TensorRT version takes), the builder options and the
engine cache key, the optimization `profile`, trtexec runs here or on a device (`runners`, `trtexec`), the one build
and verification job (`engine_job`, `verify`) and the engine `cache`. Facts about TensorRT live in docs/tensorrt.md.
"""
