"""How responses are scored: rule functions, reward models, remote reward servers, and the registry
of reward sources."""
