"""Exceptions the core raises; the server maps them to OpenAI error bodies."""


class LLMServeError(Exception):
    """Base class of every error llmserve raises on purpose."""


class ConfigError(LLMServeError, ValueError):
    """A configuration key or value is wrong; the message names the key and the file."""


class EngineDeadError(LLMServeError):
    """The engine thread is stopped (shut down or crashed); no request can run."""


class BackendUnavailableError(LLMServeError):
    """The model backend cannot answer now (a remote worker down or silent): the step's requests fail with 503, and
    a retry may succeed once it answers again."""


class BackendLostError(LLMServeError):
    """The backend lost state the engine relies on (a remote worker restarted, or another server took it over):
    the engine stops, its requests fail with 503 and /health says why, until the server is restarted."""


class PluginError(LLMServeError):
    """A plugin failed to load, or two plugins registered the same component name."""


class InvalidRequestError(LLMServeError, ValueError):
    """A request carries a bad value; `param` names the offending field, `code` is OpenAI's (if it has one)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code
