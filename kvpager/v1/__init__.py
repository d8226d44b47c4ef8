"""Generated gRPC stubs; regenerate with `python -m kvpager.protogen`."""
