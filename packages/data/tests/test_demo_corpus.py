import json

from mtl.data.demo_corpus import write_demo_corpus


def test_demo_corpus_is_deterministic_jsonl_with_repeated_structure(tmp_path):
    a = write_demo_corpus(str(tmp_path / "a.jsonl"), num_docs=200, seed=0)
    b = write_demo_corpus(str(tmp_path / "b.jsonl"), num_docs=200, seed=0)
    c = write_demo_corpus(str(tmp_path / "c.jsonl"), num_docs=200, seed=1)
    assert open(a, "rb").read() == open(b, "rb").read() != open(c, "rb").read()
    texts = [json.loads(line)["text"] for line in open(a, encoding="utf-8")]
    assert len(texts) == 200 and all(t.strip() for t in texts)
    words = " ".join(texts).split()
    # a small, repetitive vocabulary is what makes it learnable in a few hundred CPU steps
    assert len(set(words)) < 400 and len(words) > 20 * len(set(words))
    # the counting sentences are arithmetically right
    numbers = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
               "ten", "eleven", "twelve"]
    checked = 0
    for text in texts:
        for sentence_start in range(len(text)):
            if text.startswith("There ", sentence_start) and " in the field. " in text[sentence_start:]:
                head, rest = text[sentence_start:].split(" in the field. ", 1)
                a_count = numbers.index(head.split()[2])
                b_count = numbers.index(rest.split()[0].lower())
                total = numbers.index(rest.split("Now there are ")[1].split()[0])
                assert a_count + b_count == total
                checked += 1
    assert checked > 50
