// minipaged: the book's search puts pages and sections whose title holds the words asked for
// above pages that merely mention them, and above API names that contain them: "block table"
// finds chapter 3 and its section "The block table" first. Used through Sphinx's
// html_search_scorer; the fields are Sphinx's own Scorer settings, with the title bonus added.
var Scorer = {
  score: (result) => {
    const [docname, title, anchor, descr, score, filename] = result;
    const query = (new URLSearchParams(window.location.search).get("q") || "")
      .toLowerCase().trim();
    const words = query.split(/\s+/).filter((word) => word.length > 1);
    const heading = (title || "").toLowerCase();
    if (query && heading.includes(query)) return score + 100;
    if (words.length && words.every((word) => heading.includes(word))) return score + 50;
    return score;
  },
  objNameMatch: 11,
  objPartialMatch: 6,
  objPrio: { 0: 15, 1: 5, 2: -5 },
  objPrioDefault: 0,
  title: 15,
  partialTitle: 7,
  term: 5,
  partialTerm: 2,
};
