"""Ferry operator: reconciles ModelWeights into prepared artifacts and wired vLLM Deployments."""
