"""How far back Blazar's repetition penalties look: the engine applies `repeat_penalty`,
`presence_penalty` and `frequency_penalty` over the last `WINDOW` tokens of the prompt
and the generation (llama.cpp's `repeat_last_n` default, and Ollama's), and a dialect
that lets the caller name a window (Ollama's `repeat_last_n`) takes only this one."""

WINDOW = 64
