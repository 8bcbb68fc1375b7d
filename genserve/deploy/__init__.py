"""The local deployment: `genserve serve` (cli), the supervisor that starts, restarts and stops its
children (supervisor), and Envoy's configuration rendered from the Helm chart (envoy).

The top layer: cli imports service/ (the engine's command-line options) and genserve.common.
Import the submodules; this package imports none of them, so `genserve.deploy.supervisor` (which
imports no torch and no service/) stays cheap for the tools that use it.
"""
