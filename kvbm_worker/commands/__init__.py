"""Leader commands received by a worker over a transport other than its gRPC server."""
