"""The served model's name when none is given: the embedded GGUF's model.

One definition for every process: the engine reports it in `Info` for the embedded model, the
bridge names it in responses and `/v1/models` unless told another name (`genserve serve` passes
the name of the model `--model` gives, `genserve.common.model_source.ModelSource.served_name`), and the
command lines name it in `--model`'s help. It lives here, not in engine/, because the bridge
imports neither torch nor engine/.
"""

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
