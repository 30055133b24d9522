"""The pipeline stages (collect -> fit -> distill -> evaluate) as library functions; the Hydra entry
points in ``scripts/`` only compose the config and call them."""
