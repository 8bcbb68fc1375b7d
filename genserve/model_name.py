"""The served model's name when none is given: the embedded GGUF's model.

One definition for every process: the engine reports it in `Info`, the bridge names it in
responses and `/v1/models`, and the command lines name it in `--model`'s help. It lives here, not
in engine/, because the bridge imports neither torch nor engine/.
"""

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
