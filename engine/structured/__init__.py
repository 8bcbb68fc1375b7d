"""Constrained decoding: JSON schemas, regular expressions, choices and Lark grammars.

The grammar engine is llguidance (Microsoft's Rust library behind guidance; vLLM offers it as a
structured-output backend). This package turns a request's constraint into an llguidance grammar
(`spec`), compiles it once per distinct constraint against the served model's vocabulary into a
bounded cache (`compiler`, `vocab`), and gives each constrained row of a step its token mask
(`masks`), computed on a worker thread while the step's forward pass runs.

Layering: nothing here imports `engine.core` (the request only carries the compiled grammar and
its row's matcher as opaque objects) and nothing imports the model.
"""
