"""REST + SSE <-> gRPC bridge: OpenAI-style /v1/completions in front of GenerateService.

Translation only: it never imports torch or engine/ (tests/bridge checks that).
Entry points: `bridge.app.create_app` and `python -m bridge`.
"""
