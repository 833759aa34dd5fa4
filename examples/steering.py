"""Steer the default model's sentiment, all through the HTTP API: a direction computed from two
contrasting prompts' hidden states (return_hidden_states), then added to the residual stream of
another request (steering). Run `python run_server.py` first (the default model).

    python examples/steering.py [--url http://127.0.0.1:8000] [--layer 16] [--scale 2]
"""

from __future__ import annotations

import argparse
import base64

import numpy as np
from openai import OpenAI

HAPPY = ["I love this, it is wonderful and I am so happy.", "What a beautiful day, everything is great!",
         "This is the best gift ever, thank you so much!"]
SAD = ["I hate this, it is awful and I am so sad.", "What a miserable day, everything is terrible!",
       "This is the worst gift ever, I am so disappointed."]


def mean_state(client: OpenAI, model: str, texts: list[str], layer: int) -> np.ndarray:
    """The residual stream after `layer`, averaged over every position of each text, then over the texts."""
    states = []
    for text in texts:
        answer = client.completions.create(model=model, prompt=text, max_tokens=1, extra_body={
            "return_hidden_states": {"layers": [layer], "positions": "all"}})
        hidden = answer.choices[0].model_extra["hidden_states"]
        data = np.frombuffer(base64.b64decode(hidden["data"]), "<f4").reshape(hidden["shape"])
        states.append(data[0].mean(0))  # [layers, positions, hidden] -> the layer's mean over positions
    return np.mean(states, 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--layer", type=int, default=16)
    parser.add_argument("--scale", type=float, default=2.0)
    args = parser.parse_args()
    client = OpenAI(base_url=f"{args.url}/v1", api_key="none")
    model = client.models.list().data[0].id
    direction = mean_state(client, model, HAPPY, args.layer) - mean_state(client, model, SAD, args.layer)
    print(f"|happy - sad| = {np.linalg.norm(direction):.1f}")
    prompt = "My day at the office was"
    for scale in (-args.scale, 0.0, args.scale):
        answer = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0, extra_body={
            "steering": [{"layer": args.layer, "vector": direction.tolist(), "scale": scale}]})
        print(f"scale {scale:+.1f}: {prompt}{answer.choices[0].text!r}")


if __name__ == "__main__":
    main()
