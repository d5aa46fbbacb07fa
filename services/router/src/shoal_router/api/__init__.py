"""HTTP surface: FastAPI routes, OpenAI request and response models, error mapping."""
