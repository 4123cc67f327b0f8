"""The drop-in policies, each an ordinary plugin: hot-set admission, the cold-load budget,
adapter-scoped KV keys, and the baselines users compare them with."""
