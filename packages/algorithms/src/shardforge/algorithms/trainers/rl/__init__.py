"""The ONE RL step's pieces (DESIGN.md section 5): where batches come from, advantages, metrics, weight publishing."""
