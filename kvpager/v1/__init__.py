"""Generated gRPC stubs; regenerate with `python -m kvpager_tools.protogen`."""
