"""Hugging Face checkpoints in and out of jaxmoe runs: Mixtral, Qwen2-MoE, Qwen3-MoE and
DeepSeek-V3 (and models of its architecture under another name: Kimi K2).

:mod:`jaxmoe.hf.architectures` maps ``config.json`` to the model and MoE sections and
:mod:`jaxmoe.hf.hf_config` back, :mod:`jaxmoe.hf.tensors` is the table of which
transformers tensor fills which part of which jaxmoe parameter, :mod:`jaxmoe.hf.block_fp8`
reads and writes block-scaled FP8 weights, :mod:`jaxmoe.hf.files` reads and writes
safetensors shards, and :mod:`jaxmoe.hf.convert` converts a model directory into a run's
step-0 checkpoint and a run's checkpoint into a model directory (``jaxmoe convert``).
"""
