"""OpenAI's Responses API: routes, input translation, bodies, stream events, stored responses."""
