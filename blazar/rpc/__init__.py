"""gRPC plumbing shared by every process: error translation and channel helpers."""
