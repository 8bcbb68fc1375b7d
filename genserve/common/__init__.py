"""Leaf helpers shared by the engine, the gRPC service and the bridge: the `--model` spellings
(model_source) and the default model name (model_name), chat message checks (chat_messages),
tracing and JSON logs (telemetry), per-component process metrics (process_metrics) and the
port-is-free check (ports).

The bottom layer: nothing here imports engine/, service/, bridge/ or genserve.deploy, and nothing
imports torch (the bridge, which never loads torch, imports these). Import the submodules; this
package imports none of them.
"""
