"""plugvlm serving: FAISS retrieval, compositional re-ranking and heatmaps."""
