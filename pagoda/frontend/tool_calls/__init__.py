"""Tool calling: the model's tool-call text parsed back into OpenAI `tool_calls` (`parsers`), and the
grammars that make `tool_choice: "required"` or a named function a guarantee (`choice`)."""
