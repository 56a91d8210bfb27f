"""The agent's link to the control plane: the HTTP client, the node credential, and the bounded
outbox through which shards, events and upload-slot requests are relayed."""
