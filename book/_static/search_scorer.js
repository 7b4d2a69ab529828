// minipaged: the book's search prefers pages whose title or section names the words asked for
// over API names that merely contain them ("block table" finds chapter 3 before BlockTable).
// Used through Sphinx's html_search_scorer; the fields are Sphinx's own Scorer defaults, retuned.
var Scorer = {
  score: (result) => {
    const [docname, title, anchor, descr, score, filename] = result;
    return score;
  },
  objNameMatch: 8,
  objPartialMatch: 4,
  objPrio: { 0: 10, 1: 4, 2: -5 },
  objPrioDefault: 0,
  title: 40,
  partialTitle: 20,
  term: 5,
  partialTerm: 2,
};
