"""Hugging Face checkpoints in and out of jaxmoe runs: Mixtral, Qwen2-MoE and Qwen3-MoE.

:mod:`jaxmoe.hf.architectures` maps ``config.json`` to the model and MoE sections and
back, :mod:`jaxmoe.hf.tensors` is the table of which transformers tensor fills which part
of which jaxmoe parameter, :mod:`jaxmoe.hf.files` reads and writes safetensors shards, and
:mod:`jaxmoe.hf.convert` converts a model directory into a run's step-0 checkpoint and a
run's checkpoint into a model directory (``jaxmoe convert``). DeepSeek-V3 is not
converted yet (jaxmoe trains its multi-head latent attention; its weights' layout is not
mapped).
"""
