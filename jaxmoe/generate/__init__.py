"""Text generation from a run's checkpoint, with a key/value cache: to check a trained or
converted model by eye (``jaxmoe generate``).

- :mod:`jaxmoe.generate.checkpoint`: the newest readable checkpoint's model, on one device;
- :mod:`jaxmoe.generate.text`: the run's tokenizer (or bytes);
- :mod:`jaxmoe.generate.decoder`: prefill and cached single-token steps, dropless MoE;
- :mod:`jaxmoe.generate.sampling`: greedy, temperature, top-k, top-p;
- :mod:`jaxmoe.generate.speculative`: greedy decoding drafted by multi-token prediction.
"""

from jaxmoe.generate.checkpoint import RunModel, load_run_model
from jaxmoe.generate.decoder import Decoder, inference_moe
from jaxmoe.generate.sampling import Sampling
from jaxmoe.generate.text import TextCodec, run_codec

__all__ = [
    "Decoder",
    "RunModel",
    "Sampling",
    "TextCodec",
    "inference_moe",
    "load_run_model",
    "run_codec",
]
