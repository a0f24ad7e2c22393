"""The Ollama dialect: `/api/chat`, `/api/generate`, `/api/embed`, `/api/tags` and the rest."""
