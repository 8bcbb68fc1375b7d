"""genserve service: the gRPC server around the engine (auth, validation, tokenization, streaming)."""
