"""The ModelWeights API types and their CRD."""
