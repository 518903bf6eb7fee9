"""Importing this module registers every trt_spec TensorRT plugin (tensorrt.plugin, QDP) with
TensorRT's plugin registry: what `trt-spec build` imports before parsing a graph whose manifest
entry lists plugin ops. Needs tensorrt (>= 10.6); never imported otherwise."""

from trt_spec.plugins.spec_verify import register_trt_plugin

register_trt_plugin()
