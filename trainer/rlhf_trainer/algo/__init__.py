"""The algorithms: formulas, advantage estimators, policy losses, experience and batches."""
