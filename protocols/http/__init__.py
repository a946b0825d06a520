"""HTTP schemas the nodes speak: SGLang's native protocol and its keys, OpenAI's APIs.
Imports only protocols.runtime."""
