"""The GLM-5.3-Flash (``glm5_next``) model: layers, caches, batch contract, checkpoint loader."""
