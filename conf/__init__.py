"""draftsmith's Hydra config tree (conf/config.yaml and its groups)."""
