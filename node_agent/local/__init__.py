"""The workers' local API (a unix socket per attempt part) and the connection bounds it shares with
the memory tier's peer port."""
