"""Parallelism: the device mesh, sharding rules, the collectives the layers use, tensor
parallelism, ZeRO and FSDP-style block gathers, gradient synchronisation and multi-host
start-up. (The folding arithmetic is :mod:`jaxmoe.config.layout`; pipelines are
:mod:`jaxmoe.pipeline`; expert placement is :mod:`jaxmoe.placement`.)"""
