"""Object storage both sides use: the S3 client (MinIO SDK behind trainyard.protocol.storage's
interface), offline SigV4 presigning and paced uploads. The control plane verifies shards and writes
manifests with it; the worker runtime saves and restores shards with it. It imports the wire
contract (trainyard.protocol) and nothing of the control plane, the agent, the worker runtime or
the tools."""
