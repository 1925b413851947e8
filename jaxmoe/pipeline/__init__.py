"""Microbatches through the step: gradient accumulation, and pipeline parallelism.

- :mod:`jaxmoe.pipeline.microbatches`: a device's rows cut into microbatches of whole
  rows, and their gradients accumulated inside the one step (no pipeline).
- :mod:`jaxmoe.pipeline.ticks`: the tick tables of the 1F1B and interleaved pipelines.
- :mod:`jaxmoe.pipeline.params`: the blocks' parameters stacked by stage, and their specs.
- :mod:`jaxmoe.pipeline.stage`: per-stage values and the stage-to-stage ``ppermute``.
- :mod:`jaxmoe.pipeline.model`: the model cut into a chunk's blocks.
- :mod:`jaxmoe.pipeline.pipelined`: the pipelined step's losses and gradients, tick by
  tick over the table.
"""
