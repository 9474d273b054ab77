"""Images and video for GLM-5.3-Flash: preprocessing (``processor``), prompt placeholders (``prompt``),
patches and embeddings on the engine side (``pixels``, ``encoder``)."""
