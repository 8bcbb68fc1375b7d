"""The Llama-architecture network and its weight loaders."""
