"""Writes engine/builtin/tiny-qwen3 (the built-in model "tiny"): a Qwen3-shaped config and a small byte-level BPE
tokenizer. The weights are not shipped: the engine builds them with load_format="dummy".
    python3 -m engine.builtin.make_tiny_model        (only to change the built-in model)
"""
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen3Config

OUT = Path(__file__).resolve().parent / "tiny-qwen3"
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = """
The queue holds jobs until a worker has room for them. Each worker reads a few jobs, runs them on the
GPU, and writes the completions back. A job that fails is retried, and after too many tries it goes to
the dead letter stream. Tell me a story about a brave knight who crossed the mountains in winter.
List all prime numbers within one hundred: two, three, five, seven, eleven, thirteen, seventeen.
Introduce yourself. What is the capital of France? Paris is the capital of France. The quick brown fox
jumps over the lazy dog. Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000. Summarise this text in one sentence.
Translate to French: good morning, how are you today? Write a haiku about the sea and the wind.
"""


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=509, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator([CORPUS] * 4, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(OUT)
    vocab_size = 512
    assert len(tok) <= vocab_size
    config = Qwen3Config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
        rope_theta=10000.0, tie_word_embeddings=True, eos_token_id=tok.eos_token_id,
        bos_token_id=None, pad_token_id=tok.pad_token_id, torch_dtype="float32",
    )
    config.architectures = ["Qwen3ForCausalLM"]
    config.save_pretrained(OUT)


if __name__ == "__main__":
    main()
