"""The CLI, the stage graph, run directories and fingerprints, MLflow tracking, publish and registry."""
