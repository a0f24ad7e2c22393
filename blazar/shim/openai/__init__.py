"""The OpenAI dialect: `/v1/chat/completions`, `/v1/completions`, `/v1/models`."""
